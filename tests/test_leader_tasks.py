"""Leader tasks that keep the fleet's job alive, and Election.run() between terms.

``Election.run()`` on a ``ManualClock`` (its pauses follow the coordinator's clock); the
FastAPI and aiohttp leader tasks in process on a real Valkey server; and two replicas,
each a uvicorn process, whose job fails once in each and runs again within its backoff.

No ``from __future__ import annotations`` in this module: FastAPI reads the handlers'
annotations at run time.
"""

import asyncio
import contextlib
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from fastapi import FastAPI

import asynclock
from asynclock import BackendError, Backoff, Term
from asynclock.backends import MemoryBackend
from asynclock.integrations import aiohttp as aiohttp_locks
from asynclock.integrations.fastapi import FastAPILocks, LeaderTaskStatus
from asynclock.testing import ManualClock

from .conftest import eventually

ROOT = Path(__file__).resolve().parent.parent


@contextlib.asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[None]:
    """The app's lifespan (startup to shutdown) around the block."""
    async with app.router.lifespan_context(app):
        yield


class TestElectionRun:
    async def test_pauses_follow_the_coordinators_clock(self) -> None:
        """After a backend error, run() campaigns again once the ManualClock passes the
        backoff, with no real sleep."""
        clock = ManualClock()
        async with asynclock.Coordinator(MemoryBackend(clock=clock)) as coord:
            retry = Backoff(initial=30, maximum=30, jitter=False)
            election = coord.election("clocked", ttl=10, retry=retry)
            calls = 0

            async def job(term: Term) -> None:
                nonlocal calls
                calls += 1
                if calls == 1:
                    raise BackendError("a blip")
                await asyncio.Event().wait()

            task = asyncio.create_task(election.run(job))
            try:
                assert await eventually(lambda: calls == 1)
                await clock.advance(29)
                assert calls == 1
                await clock.advance(2)
                assert await eventually(lambda: calls == 2)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def test_a_callback_that_returns_does_not_spin(self) -> None:
        """A callback that returns at once leads again only after a pause that grows
        (1, 2, 4 s of the clock), not every 50 ms."""
        clock = ManualClock()
        async with asynclock.Coordinator(MemoryBackend(clock=clock)) as coord:
            retry = Backoff(initial=1, maximum=4, jitter=False)
            election = coord.election("returns", ttl=10, retry=retry)
            terms: list[float] = []

            async def job(term: Term) -> None:
                terms.append(clock.now())

            task = asyncio.create_task(election.run(job))
            try:
                assert await eventually(lambda: len(terms) == 1)
                for _ in range(10):
                    await clock.advance(1)
                await asyncio.sleep(0.2)  # real time must not bring more terms
                assert terms == [0, 1, 3, 7]
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def test_a_plain_def_is_refused_at_once(self) -> None:
        """run() refuses a callback that is not an async def before campaigning."""
        async with asynclock.connect("memory://") as coord:

            def job(term: Term) -> None:
                pass

            with pytest.raises(TypeError, match="async def"):
                await coord.election("plain").run(job)  # type: ignore[arg-type]
            assert await coord.election("plain").leader() is None


@pytest.fixture
def url(asynclock_redis_url: str) -> str:
    return asynclock_redis_url


class TestFastAPILeaderTasks:
    async def test_a_failing_job_restarts_and_its_state_is_visible(
        self, url: str, namespace: str
    ) -> None:
        """A job that raises is restarted after its backoff (default on_error="restart");
        leader_status() shows the backoff, the error, then leading again."""
        locks = FastAPILocks(url, prefix=namespace)
        runs = 0
        leading = asyncio.Event()

        async def job(term: Term) -> None:
            nonlocal runs
            runs += 1
            if runs == 1:
                raise ConnectionError("too many connections")
            leading.set()
            await asyncio.Event().wait()

        retry = Backoff(initial=0.5, maximum=0.5, jitter=False)
        locks.leader_task("jobs", job, ttl=5, retry=retry)
        assert locks.leader_status()["jobs"].state == "stopped"
        app = FastAPI(lifespan=locks.lifespan)
        async with running(app):
            assert await eventually(lambda: locks.leader_status()["jobs"].state == "backing_off")
            status: LeaderTaskStatus = locks.leader_status()["jobs"]
            assert status.error == "ConnectionError: too many connections"
            assert status.failures == 1
            assert status.retry_in is not None
            assert 0 < status.retry_in <= 0.5
            assert status.running
            await asyncio.wait_for(leading.wait(), 5)
            status = locks.leader_status()["jobs"]
            assert (status.state, status.terms, runs) == ("leading", 2, 2)
            assert status.term is not None
            assert json.loads(json.dumps(status.as_dict()))["state"] == "leading"
        status = locks.leader_status()["jobs"]
        assert (status.state, status.running) == ("stopped", False)
        assert "shut down" in status.detail

    async def test_on_error_stop_stops_the_task_and_says_why(
        self, url: str, namespace: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """With on_error="stop" a job that raises stops its task; the state says why."""
        locks = FastAPILocks(url, prefix=namespace)

        async def job(term: Term) -> None:
            raise ValueError("bug in the job")

        locks.leader_task("jobs", job, on_error="stop")
        app = FastAPI(lifespan=locks.lifespan)
        async with running(app):
            assert await eventually(lambda: locks.leader_status()["jobs"].state == "stopped")
            status = locks.leader_status()["jobs"]
            assert status.error == "ValueError: bug in the job"
            assert "not restarted" in status.detail
            assert "bug in the job" in caplog.text
            assert await locks.coordinator.election("jobs").leader() is None

    async def test_a_startup_that_fails_at_once_leaves_the_tasks_stopped(
        self, url: str, namespace: str
    ) -> None:
        """The app's own lifespan raises right after the integration's started the leader
        tasks (before they ran a step): after shutdown every task says "stopped"."""
        locks = FastAPILocks(url, prefix=namespace)

        async def job(term: Term) -> None:
            await asyncio.Event().wait()

        locks.leader_task("jobs", job)

        async def check_database() -> None:
            raise RuntimeError("database unreachable at startup")

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            async with locks.lifespan(app):
                await check_database()
            yield  # pragma: no cover - never reached: the check raises

        app = FastAPI(lifespan=lifespan)
        with pytest.raises(RuntimeError, match="database unreachable"):
            async with running(app):
                pass  # pragma: no cover
        status = locks.leader_status()["jobs"]
        assert (status.state, status.running) == ("stopped", False), status
        assert "shut down" in status.detail

    async def test_a_job_that_returns_does_not_spin(self, url: str, namespace: str) -> None:
        """A job that returns at once runs once per backoff pause (not every 50 ms)."""
        locks = FastAPILocks(url, prefix=namespace)
        runs = 0

        async def job(term: Term) -> None:
            nonlocal runs
            runs += 1

        locks.leader_task("jobs", job)
        app = FastAPI(lifespan=locks.lifespan)
        async with running(app):
            assert await eventually(lambda: runs >= 1)
            await asyncio.sleep(1.0)
            # Pauses below 1 s, then 2 s, then 4 s: at most three runs in this second.
            assert runs <= 3
            assert locks.leader_status()["jobs"].state == "backing_off"

    def test_callbacks_that_cannot_work_are_refused_at_registration(self, url: str) -> None:
        """A plain def, a callback taking no argument, a bad on_error or a name used twice
        raise when registered."""
        locks = FastAPILocks(url)

        def plain(term: Term) -> None:
            pass

        async def no_term() -> None:
            pass

        async def job(term: Term) -> None:
            pass

        with pytest.raises(TypeError, match="async def"):
            locks.leader_task("jobs", plain)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="one argument"):
            locks.leader_task("jobs", no_term)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="on_error"):
            locks.leader_task("jobs", job, on_error="ignore")  # type: ignore[arg-type]
        locks.leader_task("jobs", job)
        with pytest.raises(ValueError, match="already registered"):
            locks.leader_task("jobs", job)


class TestAiohttpLeaderTasks:
    async def test_a_failing_job_restarts_and_a_handler_sees_the_state(
        self, url: str, namespace: str
    ) -> None:
        """aiohttp: a job that raises runs again after its backoff, and a handler reads
        the state with leader_status(request)."""
        app = web.Application()
        aiohttp_locks.setup(app, url, prefix=namespace)
        runs = 0

        async def job(term: Term) -> None:
            nonlocal runs
            runs += 1
            if runs == 1:
                raise ConnectionError("too many connections")
            await asyncio.Event().wait()

        retry = Backoff(initial=0.3, maximum=0.3, jitter=False)
        aiohttp_locks.leader_task(app, "jobs", job, ttl=5, retry=retry)

        async def health(request: web.Request) -> web.Response:
            states = aiohttp_locks.leader_status(request)
            return web.json_response({name: s.as_dict() for name, s in states.items()})

        app.router.add_get("/health", health)
        async with TestClient(TestServer(app)) as client:
            assert await eventually(lambda: runs == 2, within=5)
            body = await (await client.get("/health")).json()
            assert body["jobs"]["state"] == "leading"
            assert body["jobs"]["error"] == "ConnectionError: too many connections"
        assert aiohttp_locks.leader_status(app)["jobs"].state == "stopped"

    def test_a_plain_def_is_refused_at_registration(self, url: str) -> None:
        """aiohttp: leader_task() refuses a callback that is not an async def."""
        app = web.Application()
        aiohttp_locks.setup(app, url)

        def plain(term: Term) -> None:
            pass

        with pytest.raises(TypeError, match="async def"):
            aiohttp_locks.leader_task(app, "jobs", plain)  # type: ignore[arg-type]


# -- two replicas, each a uvicorn process -----------------------------------------------

REPLICA = """
import asyncio, sys
import uvicorn
from fastapi import FastAPI
from asynclock.integrations.fastapi import FastAPILocks, LeaderTaskStatus

url, prefix, port, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
locks = FastAPILocks(url, prefix=prefix)
runs = 0

async def job(term):
    global runs
    runs += 1
    if runs == 1:  # each replica fails once, as with a pool that ran out of connections
        raise ConnectionError("Too many connections")
    await asyncio.Event().wait()

locks.leader_task("job", job, ttl=5, identity=label)
app = FastAPI(lifespan=locks.lifespan)

@app.get("/leaders")
async def leaders():
    states = getattr(locks, "leader_status", dict)()  # absent before leader states existed
    return {"runs": runs, "tasks": {name: s.as_dict() for name, s in states.items()}}

uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
"""


Seen = dict[str, object]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TestTwoReplicas:
    async def test_a_job_failing_in_both_replicas_runs_again(
        self, url: str, namespace: str, tmp_path: Path
    ) -> None:
        """Two uvicorn replicas whose job raises the first time it runs in each: the job
        runs again within the default backoff, and /leaders shows one leading and the
        error in each replica that ran it."""
        script = tmp_path / "replica.py"
        script.write_text(REPLICA)
        ports = {label: free_port() for label in ("a", "b")}
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, str(script), url, namespace, str(port), label, cwd=ROOT
            )
            for label, port in ports.items()
        ]
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=2) as client:

                async def look() -> dict[str, Seen]:
                    seen: dict[str, Seen] = {}
                    for label, port in ports.items():
                        with contextlib.suppress(httpx.TransportError):
                            reply = await client.get(f"http://127.0.0.1:{port}/leaders")
                            seen[label] = reply.json()
                    return seen

                async def until(
                    done: Callable[[dict[str, Seen]], bool], within: float
                ) -> dict[str, Seen]:
                    deadline = time.monotonic() + within
                    # Polls other processes over HTTP: there is no event to wait on.
                    while not done(seen := await look()) and time.monotonic() < deadline:  # noqa: ASYNC110
                        await asyncio.sleep(0.1)
                    return seen

                def runs(seen: dict[str, Seen]) -> int:
                    return sum(int(str(s["runs"])) for s in seen.values())

                # Generous deadlines: starting Python with FastAPI on a busy machine is slow.
                seen = await until(lambda seen: len(seen) == 2, within=60)
                assert len(seen) == 2, f"replicas did not answer: {seen}"

                # The first leader's job fails once; the job then runs again (in either
                # replica: the other one may not be campaigning yet) and stays running.
                def settled(seen: dict[str, Seen]) -> bool:
                    leading = [s for s in seen.values() if task_of(s)["state"] == "leading"]
                    return runs(seen) >= 2 and len(leading) == 1

                seen = await until(settled, within=30)
                assert settled(seen), seen
                tasks = {label: task_of(s) for label, s in seen.items()}
                assert sorted(str(t["state"]) for t in tasks.values()) in (
                    ["campaigning", "leading"],
                    ["backing_off", "leading"],
                ), tasks
                for label, status in tasks.items():
                    assert status["running"] is True
                    if int(str(seen[label]["runs"])) >= 1:  # it failed once: it says so
                        assert status["error"] == "ConnectionError: Too many connections"
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.terminate()
            for proc in procs:
                await proc.wait()


def task_of(seen: Seen) -> dict[str, object]:
    """The "job" task's status fields from a replica's /leaders answer."""
    tasks = seen["tasks"]
    assert isinstance(tasks, dict)
    task = tasks["job"]
    assert isinstance(task, dict)
    return task
